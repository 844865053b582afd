"""``python -m serve.train``: the same command as ``python -m serve.model.train`` (the name
the fresh-embeddings walk-through uses). Offline build code: never imported by the pod."""
from __future__ import annotations

import sys

if __name__ == "__main__":
    from serve.model.train import main

    sys.exit(main())
