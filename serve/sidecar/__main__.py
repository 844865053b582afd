"""``python -m serve.sidecar``: run the sidecar under uvicorn."""
from serve.sidecar.http.app import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
