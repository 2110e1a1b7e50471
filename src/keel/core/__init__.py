"""The contracts every layer shares: the train state, the actions a component may ask for, the step's
one host synchronisation, the callback protocol, DTensor helpers and the accelerator catalog. Imports
nothing of keel but `keel.errors`."""
