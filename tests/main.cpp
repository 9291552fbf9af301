#define BOOST_TEST_MODULE remat
#include <boost/test/unit_test.hpp>
