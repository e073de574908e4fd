"""Tests of laya_aot.pipeline."""
