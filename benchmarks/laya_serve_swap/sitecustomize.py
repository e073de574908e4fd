"""Makes `laya.serve.create_app` laya-aot serve's app, in this interpreter and every child Python that inherits
PYTHONPATH (laya's tests start some): used by benchmarks/laya_serve_tests.py to run laya's own server tests
against `laya-aot serve`, built the way those tests build laya's (`create_app(router=...)`, or from LAYA_*).

Installed when `laya.serve` is first imported, so an interpreter that never imports it is unchanged."""
import functools
import importlib.abc
import importlib.util
import sys


def _swap(module):
    laya_create_app = module.create_app

    @functools.wraps(laya_create_app)
    def create_app(router=None):
        from laya_aot import serve

        # laya_aot.serve builds on laya's create_app by its module name: it sees laya's own during the call
        module.create_app = laya_create_app
        try:
            return serve.create_app(router=router)
        finally:
            module.create_app = create_app

    create_app.laya_aot_swapped = True
    module.create_app = create_app


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _swap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "laya.serve":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


sys.meta_path.insert(0, _Finder())
