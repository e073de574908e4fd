"""Tests of laya_aot.numerics."""
