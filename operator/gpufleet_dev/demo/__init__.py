"""The local demo: load against a real engine behind the operator, and a report."""
