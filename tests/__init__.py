"""laya-aot's tests: a package, so that tests/kernels, tests/runtime and the rest are tests.kernels and
tests.runtime, never top-level `kernels` or `runtime` shadowing installed packages (transformers imports `kernels`)."""
