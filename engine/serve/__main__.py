from engine.serve import main

main()
