"""``python -m kv_budget_demo`` (``make demo``): see :mod:`kv_budget_demo.demo`."""

import sys

from kv_budget_demo.demo import main

sys.exit(main())
