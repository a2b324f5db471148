from zmqps.cli.entry import main

raise SystemExit(main())
