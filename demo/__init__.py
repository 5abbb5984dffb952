"""The bundled demo: a small trained Llama-architecture model and sample documents about
invented entities, the embedded default of `ragblend up` (see demo/README.md)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent
MODEL_DIR = DEMO_DIR / "model"
DOCUMENTS_DIR = DEMO_DIR / "documents"
