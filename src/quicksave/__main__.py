"""``python -m quicksave`` runs the command line."""

from quicksave.cli.main import main

raise SystemExit(main())
