"""``python -m kvpolicy``: the `kvpolicy` command line."""

from kvpolicy.engine.cli.main import main

raise SystemExit(main())
