import runpy, sys
tree = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") or getattr(type(f), "__module__", ""))]
sys.path.insert(0, tree)
sys.argv = [tree + "/benchmarks/start_once.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
