"""``python -m cula.cli`` runs the ``cula`` app (for machines where the console script is not on PATH)."""

from cula.cli.app import main

main()
