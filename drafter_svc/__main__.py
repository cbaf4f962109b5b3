import sys

from drafter_svc.server import main

sys.exit(main())
