"""Tests of laya_aot.distribution."""
