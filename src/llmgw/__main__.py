"""``python -m llmgw``, and the ``llmgw`` command's entry point."""

import sys


def main() -> None:
    """Run the ``llmgw`` command; a Ctrl-C while it is still starting is one line and exit status 130."""
    try:
        from llmgw.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("llmgw: interrupted\n")
        sys.exit(130)
    cli()


if __name__ == "__main__":
    main()
