"""Tests of laya_aot.cli."""
