"""Tests of laya_aot.runtime."""
