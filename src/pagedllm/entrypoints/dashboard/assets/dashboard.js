// The pagedllm dashboard: draws the events of dashboard/events (server-sent, ~4 a second). No libraries.
"use strict";
(function () {
  const MAX_POINTS = 480; // two minutes of history at 4 updates a second
  const MAX_GRID_HEIGHT = 320; // px
  const STATE_COLORS = ["--free", "--cached", "--used", "--shared"]; // core/block_pool's FREE, CACHED, USED, SHARED
  const ENGINE_FIELDS = [
    ["model", "name"], ["served names", "served_names"], ["model dir", "model_dir"], ["device", "device"],
    ["device name", "device_name"], ["dtype", "dtype"], ["KV cache dtype", "kv_cache_dtype"],
    ["quantization", "quantization"], ["max_model_len", "max_model_len"], ["block size", "block_size"],
    ["KV blocks", "num_blocks"], ["max_num_seqs", "max_num_seqs"], ["max_num_batched_tokens", "max_num_batched_tokens"],
    ["tensor / pipeline / data parallel", "parallel"], ["prefix caching", "prefix_caching"],
    ["async scheduling", "async_scheduling"], ["speculative decoding", "speculative"], ["LoRA", "lora"],
    ["pagedllm", "pagedllm"], ["torch", "torch"], ["transformers", "transformers"], ["python", "python"],
    ["API / engine pid", "pids"],
  ];
  const $ = (id) => document.getElementById(id);
  const series = { running: [], waiting: [], preempted: [], prompt: [], gen: [] };
  let updates = 0;
  let source = null;
  let retry = null;
  let lastEvent = null;
  let engineShown = "";

  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
  function int(n) { return n === null || n === undefined ? "\u2013" : Math.round(n).toLocaleString("en-US"); }
  function num(n, digits) {
    if (n === null || n === undefined) return "\u2013";
    return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }
  function pct(x) { return x === null || x === undefined ? "\u2013" : num(100 * x, 1) + " %"; }
  function secs(x) {
    if (x === null || x === undefined) return "\u2013";
    return x < 1 ? num(1000 * x, x < 0.01 ? 2 : 1) + " ms" : num(x, 2) + " s";
  }
  function duration(s) {
    s = Math.floor(s);
    const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + m + "m";
    return m + "m " + (s % 60) + "s";
  }
  function text(id, value) { const el = $(id); if (el.textContent !== value) el.textContent = value; }

  function push(key, value) {
    const arr = series[key];
    arr.push(value);
    if (arr.length > MAX_POINTS) arr.shift();
  }

  function sized(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
      canvas.width = Math.round(w * ratio);
      canvas.height = Math.round(h * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return { ctx, w, h };
  }

  function decode(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  // The KV pool: one square per cell (a block, or several when the pool is large), row by row, pool after pool.
  function drawGrid(kv) {
    const canvas = $("kv-grid");
    const pools = kv.pools.filter((p) => p.cells);
    const cells = pools.map((p) => decode(p.cells));
    const total = cells.reduce((n, c) => n + c.length, 0);
    const counts = [0, 0, 0, 0];
    if (!total) return;
    // squares as large as fit in MAX_GRID_HEIGHT (at most 18 px), the canvas as tall as the rows it needs
    const w = canvas.clientWidth;
    const gap = 10 * (pools.length - 1);
    const rowsAt = (size) => cells.reduce((rows, c) => rows + Math.ceil(c.length / Math.max(1, Math.floor(w / size))), 0);
    let size = Math.max(3, Math.min(18, Math.floor(Math.sqrt((w * (MAX_GRID_HEIGHT - gap)) / total))));
    while (size > 3 && rowsAt(size) * size + gap > MAX_GRID_HEIGHT) size--;
    const height = rowsAt(size) * size + gap;
    if (canvas.style.height !== height + "px") canvas.style.height = height + "px";
    const { ctx } = sized(canvas);
    const perRow = Math.max(1, Math.floor(w / size));
    const inset = size >= 6 ? 1 : 0;
    const colors = STATE_COLORS.map(css);
    let y = 0;
    cells.forEach((c) => {
      for (let i = 0; i < c.length; i++) {
        const state = c[i] & 3;
        counts[state]++;
        ctx.fillStyle = colors[state];
        ctx.fillRect((i % perRow) * size, y + Math.floor(i / perRow) * size, size - inset, size - inset);
      }
      y += Math.ceil(c.length / perRow) * size + 10;
    });
    // for tests and curious users: what the grid shows right now
    canvas.dataset.cells = String(total);
    canvas.dataset.free = String(counts[0]);
    canvas.dataset.cached = String(counts[1]);
    canvas.dataset.used = String(counts[2] + counts[3]);
  }

  function drawLines(canvasId, lines, unit) {
    const canvas = $(canvasId);
    const { ctx, w, h } = sized(canvas);
    const left = 44, bottom = 4, top = 8;
    let max = 0;
    lines.forEach((l) => l.values.forEach((v) => { if (v > max) max = v; }));
    const scale = niceScale(max);
    max = scale.max;
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = css("--muted");
    ctx.strokeStyle = css("--line");
    ctx.lineWidth = 1;
    for (let k = 0; k <= scale.ticks; k++) {
      const y = top + (h - top - bottom) * (1 - k / scale.ticks);
      ctx.beginPath();
      ctx.moveTo(left, Math.round(y) + 0.5);
      ctx.lineTo(w, Math.round(y) + 0.5);
      ctx.stroke();
      const label = max * k / scale.ticks;
      ctx.fillText(label >= 1000 ? +(label / 1000).toFixed(1) + "k" : String(+label.toFixed(2)), 2, y + 4);
    }
    const span = MAX_POINTS - 1;
    lines.forEach((l) => {
      const n = l.values.length;
      if (!n) return;
      ctx.strokeStyle = css(l.color);
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      l.values.forEach((v, i) => {
        const x = left + (w - left) * ((span - (n - 1 - i)) / span);
        const y = top + (h - top - bottom) * (1 - (max ? v / max : 0));
        if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
      });
      ctx.stroke();
    });
    canvas.dataset.max = String(max);
    canvas.dataset.unit = unit;
  }

  // the axis' top (1, 2, 2.5 or 5 times a power of ten) and a tick count that gives round steps (whole ones up to 5)
  function niceScale(v) {
    if (v <= 0) return { max: 1, ticks: 1 };
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    const [m, ticks] = [[1, 5], [2, 4], [2.5, 5], [5, 5], [10, 5]].find(([x]) => v <= x * p);
    const max = m * p;
    return { max, ticks: Number.isInteger(max) && max <= 5 ? max : ticks };
  }

  function showEngine(model) {
    const names = (model.served_names || []).join(", ");
    const values = Object.assign({}, model, {
      served_names: names === model.name ? "" : names,
      model_dir: model.model_dir === model.name ? "" : model.model_dir,
      parallel: [model.tensor_parallel_size, model.pipeline_parallel_size, model.data_parallel_size]
        .map((x) => (x === undefined ? "?" : x)).join(" / "),
      pids: model.api_pid + " / " + (model.engine_pid === undefined ? "?" : model.engine_pid),
    });
    const key = JSON.stringify(values);
    if (key === engineShown) return;
    engineShown = key;
    const body = $("engine-info").tBodies[0];
    body.replaceChildren();
    ENGINE_FIELDS.forEach(([label, field]) => {
      const v = values[field];
      if (v === undefined || v === null || v === "") return;
      const tr = document.createElement("tr");
      const th = document.createElement("th");
      const td = document.createElement("td");
      th.textContent = label;
      td.textContent = typeof v === "number" ? v.toLocaleString("en-US") : String(v);
      tr.append(th, td);
      body.append(tr);
    });
    text("model-name", model.name || "");
    document.title = "pagedllm \u00b7 " + (model.name || "dashboard");
    text("replica", "API process " + model.api_pid);
  }

  function showLora(lora) {
    $("lora-off").classList.toggle("hidden", !!lora);
    $("lora-table").classList.toggle("hidden", !lora);
    if (!lora) return;
    const body = $("lora-table").tBodies[0];
    body.replaceChildren();
    const rows = [{ name: "(base model)", id: 0, running: lora.base_running, waiting: lora.base_waiting }]
      .concat(lora.adapters);
    rows.forEach((a) => {
      const tr = document.createElement("tr");
      [a.name, a.id, int(a.running), int(a.waiting)].forEach((v, i) => {
        const cell = document.createElement(i === 0 ? "th" : "td");
        cell.textContent = String(v);
        if (i === 0 && a.path) cell.title = a.path;
        tr.append(cell);
      });
      body.append(tr);
    });
  }

  function showSpec(spec) {
    $("spec-off").classList.toggle("hidden", !!spec);
    $("spec-on").classList.toggle("hidden", !spec);
    if (!spec) return;
    text("spec-rate", pct(spec.acceptance_rate));
    text("spec-rate-total", pct(spec.acceptance_rate_total));
    text("spec-len", spec.mean_acceptance_length === null ? "\u2013" : num(spec.mean_acceptance_length, 2));
    text("spec-drafted", int(spec.draft_tokens_total));
    const box = $("spec-positions");
    box.replaceChildren();
    spec.per_position.forEach((p, i) => {
      const bar = document.createElement("div");
      bar.className = "pos";
      bar.style.height = Math.max(1, Math.round(100 * p)) + "%";
      bar.title = "position " + (i + 1) + ": " + pct(p);
      const label = document.createElement("span");
      label.textContent = Math.round(100 * p) + "%";
      bar.append(label);
      box.append(bar);
    });
  }

  function status(ev) {
    const el = $("status");
    const labels = { ok: "running", engine_dead: "engine stopped", draining: "shutting down" };
    el.textContent = labels[ev.status] || ev.status;
    el.className = "badge " + (ev.status === "ok" ? "badge-ok" : ev.status === "draining" ? "badge-wait" : "badge-bad");
    el.title = ev.status_detail || "";
  }

  function render(ev) {
    status(ev);
    text("uptime", duration(ev.uptime_s));
    text("updates", int(updates));
    const kv = ev.kv;
    text("kv-usage", pct(kv.usage));
    text("kv-used", int(kv.used + kv.shared) + " / " + int(kv.num_blocks));
    text("kv-cached", int(kv.cached));
    text("kv-free", int(kv.free));
    text("kv-tokens-free", int(kv.tokens_free));
    text("kv-capacity", int(kv.tokens_capacity) + " tokens");
    const k = Math.max(...kv.pools.map((p) => p.blocks_per_cell), 1);
    text("kv-scale", (k > 1 ? "one square = " + k + " blocks" : "one square = one block") + " of " + kv.block_size +
         " tokens" + (kv.pools.length > 1 ? " \u00b7 one grid per engine core" : ""));
    drawGrid(kv);

    const r = ev.requests;
    text("req-running", int(r.running));
    text("req-waiting", int(r.waiting));
    text("req-preempted", int(r.preempted));
    text("req-preemptions", int(r.preemptions_total));
    text("req-finished", int(r.finished_total));
    drawLines("chart-requests", [
      { values: series.running, color: "--running" }, { values: series.waiting, color: "--waiting" },
      { values: series.preempted, color: "--preempted" }], "requests");

    const t = ev.throughput;
    text("tp-prompt", num(t.prompt_tokens_per_s, 0));
    text("tp-gen", num(t.generation_tokens_per_s, 0));
    text("tp-prompt-total", int(t.prompt_tokens_total));
    text("tp-gen-total", int(t.generation_tokens_total));
    drawLines("chart-throughput", [
      { values: series.prompt, color: "--prompt" }, { values: series.gen, color: "--gen" }], "tokens/s");

    const lat = ev.latency;
    text("lat-window", "last " + Math.round(lat.window_s) + " s");
    ["ttft", "tpot", "e2e"].forEach((key) => {
      ["p50", "p90", "p99"].forEach((q) => text(key + "-" + q, secs(lat[key][q])));
      text(key + "-count", int(lat[key].count));
    });

    const pc = ev.prefix_cache;
    text("pc-rate", pct(pc.hit_rate));
    text("pc-rate-total", pct(pc.hit_rate_total));
    text("pc-queries", int(pc.queried_tokens_total));
    text("pc-hits", int(pc.hit_tokens_total));
    $("pc-bar").style.width = (100 * (pc.hit_rate || 0)).toFixed(1) + "%";

    showEngine(ev.model);
    showLora(ev.lora);
    showSpec(ev.spec_decode);
    document.body.dataset.updates = String(updates);
    document.body.dataset.seq = String(ev.seq);
  }

  function addPoint(p) {
    push("running", p.running);
    push("waiting", p.waiting);
    push("preempted", p.preempted);
    push("prompt", p.prompt_tps);
    push("gen", p.gen_tps);
  }

  function onMessage(msg) {
    const ev = JSON.parse(msg.data);
    updates++;
    if (ev.history) { // the first event of a connection: the last minute the server kept
      Object.keys(series).forEach((key) => { series[key].length = 0; });
      ev.history.forEach(addPoint);
    } else {
      addPoint(ev.point);
    }
    lastEvent = ev;
    render(ev);
    text("conn", "live");
  }

  function connect() {
    retry = null;
    source = new EventSource("dashboard/events");
    source.onmessage = onMessage;
    source.onerror = () => {
      text("conn", "disconnected, reconnecting\u2026");
      const el = $("status");
      el.textContent = "disconnected";
      el.className = "badge badge-wait";
      if (source.readyState === EventSource.CLOSED && retry === null) { // refused (e.g. 401 / 503): try again later
        retry = setTimeout(connect, 3000);
      }
    };
  }

  window.addEventListener("resize", () => { if (lastEvent) render(lastEvent); });
  connect();
})();
