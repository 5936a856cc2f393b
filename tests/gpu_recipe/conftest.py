"""The GPU recipe's tests import their shared HTTP stand-ins (stub_http) from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
