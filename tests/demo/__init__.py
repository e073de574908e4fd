"""Tests of laya_aot.demo."""
