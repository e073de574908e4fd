"""Tests of laya_aot.kinds."""
