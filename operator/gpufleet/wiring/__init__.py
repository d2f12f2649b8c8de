"""The operator's wiring: what kopf calls (``handlers``), the process that owns the loops, the watches and
leadership (``runtime``), and one reconcile of one service (``controller``, with its children's reads and
writes in ``children``). Everything below it decides (the pure packages) or runs a loop (``fleet``);
nothing below imports it."""
