"""Tests of laya_aot.project."""
