"""Reading a run directory back: the HTML run report (`keel report`) and the terminal summary (`keel status`)."""
