from moefit.cli import main

raise SystemExit(main())
