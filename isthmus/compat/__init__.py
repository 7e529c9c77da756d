"""Where isthmus reaches other libraries' internals: one module per library."""
