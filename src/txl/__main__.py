from txl.cli import main

raise SystemExit(main())
