"""`make selftest`: the overlay's DSpark checked on this node's device before it serves
(``__main__``), and the record preflight reads (``record``)."""
