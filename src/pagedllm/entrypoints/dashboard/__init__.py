"""The live dashboard of `pagedllm serve` (GET /dashboard): one self-contained page (assets/, shipped as package
data) fed by server-sent events. routes.py: the HTTP side and the key check; feed.py: one sampler for all open
pages; summary.py: rates, windowed percentiles and the KV grid; engine_side.py: the engine core's answer to
GetDashboard (messages.py)."""
