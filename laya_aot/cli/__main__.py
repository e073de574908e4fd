"""`python -m laya_aot.cli`: the `laya-aot` command."""
import sys

from . import main

sys.exit(main())
