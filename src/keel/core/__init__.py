"""The contracts every layer shares: the train state, the actions a component may ask for, the step's
one host synchronisation, the callback protocol, DTensor helpers, the accelerator catalog and how a
process exits. Imports nothing of keel but `keel.errors`."""
