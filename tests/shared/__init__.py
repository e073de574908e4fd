"""Tests of laya_aot.shared."""
