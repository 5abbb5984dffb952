"""`python -m ragblend` runs the command line."""

from ragblend.cli import main

raise SystemExit(main())
