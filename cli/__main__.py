"""`python -m cli ...` runs the `tether` command (the images' shim uses it)."""

from cli import main

main()
