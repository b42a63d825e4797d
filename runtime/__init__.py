"""What a long-running Tether process (a control plane, an engine agent) sets up about
itself: its cycle collector (`collector`) and the tallies its metrics export
(`loop_metrics`)."""
