"""``python -m llmgw``, and the ``llmgw`` command's entry point."""

import os
import sys


def main() -> None:
    """Run the ``llmgw`` command; a Ctrl-C while it is still starting is one line and exit status 130.

    gRPC's own C-core log lines (a line per failed TLS handshake, every retry) stay off the
    terminal unless ``GRPC_VERBOSITY`` says otherwise: what a failed call means is in llmgw's log.
    """
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # (before grpc is imported: it reads it once)
    try:
        from llmgw.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("llmgw: interrupted\n")
        sys.exit(130)
    cli()


if __name__ == "__main__":
    main()
