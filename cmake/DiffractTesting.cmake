# diffract_add_test(<name> LABELS <label>... [FIXTURES])
# One Qt Test executable from tests/<name>.cpp, linked to the core, registered with CTest.
# FIXTURES: needs the reference oracle's output (tests/reference/make_fixtures.py).
function(diffract_add_test name)
  cmake_parse_arguments(ARG "FIXTURES" "" "LABELS;LIBRARIES" ${ARGN})
  add_executable(${name} ${name}.cpp)
  target_link_libraries(${name} PRIVATE diffract_core Qt6::Test ${ARG_LIBRARIES})
  if(DIFFRACT_PCH)
    if("diffract_ui" IN_LIST ARG_LIBRARIES)
      target_precompile_headers(${name} REUSE_FROM diffract_gui_test_pch)
    else()
      target_precompile_headers(${name} REUSE_FROM diffract_test_pch)
    endif()
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES
    LABELS "${ARG_LABELS}"
    ENVIRONMENT "QT_QPA_PLATFORM=offscreen;DIFFRACT_FIXTURES=${DIFFRACT_FIXTURES_DIR};DIFFRACT_SHARED=${DIFFRACT_SHARED_DIR};DIFFRACT_EMBEDDED_MODEL=${CMAKE_BINARY_DIR}/no-embedded-model")
  if(ARG_FIXTURES)
    set_tests_properties(${name} PROPERTIES FIXTURES_REQUIRED reference)
  endif()
endfunction()
