from keel.cli import main
from keel.core.process import exit_now

exit_now(main())
