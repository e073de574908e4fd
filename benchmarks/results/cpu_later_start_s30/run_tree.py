"""Run benchmarks/start_once.py from the tree named first, whatever laya-aot the venv has installed editable.

    python run_tree.py TREE bundle CHECKPOINT BUNDLE
"""
import runpy
import sys

tree = sys.argv[1]
# the editable install's finder would import laya_aot from the installed tree, not from TREE
sys.meta_path = [f for f in sys.meta_path
                 if "editable" not in (getattr(f, "__module__", "") or getattr(type(f), "__module__", ""))]
sys.path.insert(0, tree)
sys.argv = [tree + "/benchmarks/start_once.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
