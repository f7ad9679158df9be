"""GatingTopK: the router Cell."""
