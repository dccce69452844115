"""GPU tests run on a CUDA machine (`make test-gpu`, i.e. `pytest -m gpu tests`). Without Triton (CI, CPU-only
installs) the kernel test modules skip at import with that reason (`pytest.importorskip`), so they show in the
summary as skipped instead of vanishing; the rest skip without CUDA."""
