"""A session's life after admission: state changes, the start spec sent to agents, reconciling agents' reports, live events."""
