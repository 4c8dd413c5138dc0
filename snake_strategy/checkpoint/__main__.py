"""``python -m snake_strategy.checkpoint``: see cli.py."""
from snake_strategy.checkpoint.cli import main

raise SystemExit(main())
