from txl.cli.main import main

raise SystemExit(main())
