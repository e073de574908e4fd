"""Tests of laya_aot.serve."""
