"""isthmus: an open single-controller runtime for JAX.

The stock jax client (``JAX_PLATFORMS=proxy``) talks the IFRT proxy protocol to an isthmus
server, which runs the programs on its devices. See the README for the commands.
"""

from isthmus.client import connect
from isthmus.errors import IsthmusError

__all__ = ["IsthmusError", "connect", "__version__"]

__version__ = "0.1.0"
