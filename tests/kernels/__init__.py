"""Tests of laya_aot.kernels."""
