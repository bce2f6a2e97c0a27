# Joins one CPU level's kernel objects into one relocatable object and gives its weak symbols a prefix of their own.
#
#   cmake -DOBJECTS=a.o;b.o -DOUTPUT=out.o -DPREFIX=attnpp_avx2. -DLINKER=ld -DNM=nm -DREADELF=readelf
#         -DOBJCOPY=objcopy -P this
#
# Inline and template functions (Eigen's, the standard library's, attnpp's own) are emitted in every object that
# uses them as weak symbols, and the linker keeps one copy of each. Compiled once per CPU level, the copies
# differ: the kept one could be the AVX-512 copy, called from the baseline path of a CPU without AVX-512. The
# COMDAT groups that hold them are renamed too: the linker keeps one group per name and drops the sections of the
# others, with the symbols defined there (a destructor's D5 group, whose signature is a local symbol, left
# renamed D1/D2 destructors undefined, and a null pointer called at exit). The level's own entry points are
# strong symbols in its namespace (cpu_avx2::kernels) and keep their names.
# Undefined symbols (libc, libgomp, the level-independent parts of attnpp) are left alone.

# The names to rename in `object`: its COMDAT groups' signatures and its weak symbols (nm's W/V: weak function or
# object; u: unique global, a static of an inline function).
function(shared_names object out)
  execute_process(COMMAND "${READELF}" -gW "${object}" OUTPUT_VARIABLE groups RESULT_VARIABLE status1)
  execute_process(COMMAND "${NM}" --defined-only -P "${object}" OUTPUT_VARIABLE symbols RESULT_VARIABLE status2)
  if(status1 OR status2)
    message(FATAL_ERROR "${READELF} or ${NM} failed on ${object}")
  endif()
  set(names "")
  string(REPLACE "\n" ";" lines "${groups}\n${symbols}")
  foreach(line IN LISTS lines)
    # readelf -g: "COMDAT group section [    2] `.group' [signature] contains 2 sections:"; nm -P: "name type ..."
    # (two ifs: a failed MATCHES in the same condition would clear CMAKE_MATCH_1)
    if(line MATCHES "^COMDAT group section .* \\[([^ ]+)\\] contains")
      list(APPEND names "${CMAKE_MATCH_1}")
    elseif(line MATCHES "^([^ ]+) [WVu] ")
      list(APPEND names "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES names)
  set(${out} "${names}" PARENT_SCOPE)
endfunction()

execute_process(COMMAND "${LINKER}" -r -o "${OUTPUT}.joined" ${OBJECTS} RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${LINKER} -r failed for ${OUTPUT}")
endif()
shared_names("${OUTPUT}.joined" names)
set(renames "")
foreach(name IN LISTS names)
  string(APPEND renames "${name} ${PREFIX}${name}\n")
endforeach()
file(WRITE "${OUTPUT}.renames" "${renames}")
execute_process(COMMAND "${OBJCOPY}" "--redefine-syms=${OUTPUT}.renames" "${OUTPUT}.joined" "${OUTPUT}"
                RESULT_VARIABLE status)
if(status)
  message(FATAL_ERROR "${OBJCOPY} failed for ${OUTPUT}")
endif()

# Every group and weak symbol of the result carries the prefix, or the build stops here rather than at a SIGILL.
shared_names("${OUTPUT}" names)
string(REPLACE "." "\\." prefix_regex "${PREFIX}")
foreach(name IN LISTS names)
  if(NOT name MATCHES "^${prefix_regex}")
    message(FATAL_ERROR "${OUTPUT}: ${name} was not renamed")
  endif()
endforeach()
