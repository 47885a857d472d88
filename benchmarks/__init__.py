"""perfmon's benchmark scripts (run from this folder: ``cd benchmarks && python overhead.py``) and the real-GPU
check (``python -m benchmarks.gpucheck`` from the checkout's root). A regular package, not a namespace one, so
no ``benchmarks`` package installed elsewhere can shadow it on a bare machine's Python."""
