from zmqps.cli.main import main

raise SystemExit(main())
