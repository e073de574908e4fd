"""Tests of laya_aot.modeling: the module artifacts are exported from."""
