from convfirstnet.cli import main

raise SystemExit(main())
