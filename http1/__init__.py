"""Tether's own HTTP/1.1 client, shared by the hot paths of the router and the agents."""
